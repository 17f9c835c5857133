# Two commands on a fresh Debian machine (as root):
#   make lab    build the LXC lab and run site.yml against it (the main job)
#   make test   lint, unit tests and every Molecule scenario
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

VENV      := .venv
BIN       := $(VENV)/bin
# Each clone has its own lab (containers, bridge, subnet, keys): by default "lab-" and a short hash of
# this clone's path (tests/lab/labctl.py picks it); LAB=name picks another.
LAB       ?=
LABCTL_LAB = $(if $(LAB),--lab $(LAB))
LAB_NODES ?= 2
LAB_FIXTURES ?= h200-x1,h200-x2
export PATH := $(CURDIR)/$(BIN):$(PATH)
export ANSIBLE_INJECT_FACT_VARS := False
export MOLECULE_GLOB := tests/molecule/*/molecule.yml

PY_DIRS := library module_utils plugins tests roles benchmarks playbooks ddtree

.PHONY: help host-deps venv lab-venv lab lab-down lint unit molecule test

help:
	@echo "make lab       build the lab (LAB_NODES=$(LAB_NODES)) and run site.yml against it"
	@echo "make test      yamllint, ansible-lint, ruff, pytest and the Molecule scenarios"
	@echo "make lab-down  remove every container, bridge and key this clone's lab made"

host-deps:
	@tests/lab/host-deps.sh

# requirements.txt: what an operator's controller needs, and all that `make lab` installs (the lab
# tool and the stand-in engines need only the standard library, and numpy for the fake drafter's
# weights, which matplotlib brings); requirements-test.txt (which starts
# with it) adds the lint, test and benchmark tools (torch and triton among them) for `make test`.
# A change to either re-installs.
$(BIN)/.installed-lab: requirements.txt
	@test -x $(BIN)/python || /usr/bin/python3 -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements.txt
	@touch $@

$(BIN)/.installed: requirements.txt requirements-test.txt
	@test -x $(BIN)/python || /usr/bin/python3 -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements-test.txt
	@touch $@ $(BIN)/.installed-lab

lab-venv: host-deps $(BIN)/.installed-lab

venv: host-deps $(BIN)/.installed

lab: lab-venv
	$(BIN)/python tests/lab/labctl.py up $(LABCTL_LAB) --nodes $(LAB_NODES) \
	  --fixtures $(LAB_FIXTURES) --inventory-dir inventory/lab --replay-measured
	# The controller's wheel cache (the deployed release's real vLLM wheel from PyPI, once) that the lab installs from.
	$(BIN)/ansible-playbook tests/lab/wheelhouse.yml -e lab_deployed_only=true
	$(BIN)/ansible-playbook site.yml

lab-down: lab-venv
	$(BIN)/python tests/lab/labctl.py down $(LABCTL_LAB)

lint: venv
	$(BIN)/yamllint --strict .
	$(BIN)/ansible-lint
	$(BIN)/ruff check $(PY_DIRS)
	$(BIN)/ruff format --check $(PY_DIRS)

unit: venv
	$(BIN)/pytest

molecule: venv
	$(BIN)/molecule test --all

test: lint unit molecule
