"""The DDTree engine's CPU tests (Triton's interpreter, vLLM stood in for), run by pytest with the repo's tests."""
