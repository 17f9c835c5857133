"""Options shared by the modules that talk to an OpenAI-compatible server (openai_probe, openai_bench)."""


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  url:
    description: Base URL of the server, e.g. C(http://127.0.0.1:8000).
    type: str
    required: true
  api_key:
    description: Bearer token for C(/v1/*). Never logged or returned.
    type: str
  model:
    description: Model name for the completions; default is the first one C(/v1/models) lists.
    type: str
"""
