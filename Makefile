# The two commands a newcomer needs: `make up` runs Fleet, `make test` runs the whole test suite (what CI runs).
# `make check` is the contributor's fast lane: lint, types and the tests that need no server process.
# All create .venv on first use (with uv, cached between runs).
.PHONY: up test check venv lint bench lock docs docs-serve image

up:
	bash scripts/up.sh

test:
	bash scripts/test.sh

check:
	bash scripts/check.sh

venv:
	bash scripts/venv.sh all test bench docs

lint: venv
	.venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/mypy

# Fleet's container image, localhost/fleet-inference:VERSION (deploy/image/Containerfile, built with buildah; see
# docs/guides/container-image.md). `make image REPOSITORY=path/to/models` ships a model repository in /models,
# `make image VARIANT=cuda` builds the CUDA variant (VERSION-cuda).
image: venv
	bash scripts/image/build.sh $(if $(VARIANT),--variant $(VARIANT),) $(if $(REPOSITORY),--repository $(REPOSITORY),)

# Every benchmark this machine can run (`make bench ONLY=dag,priority` for some), results in benchmarks/results/.
bench:
	bash scripts/bench.sh $(if $(ONLY),--only $(ONLY),)

# Re-resolve uv.lock after a change to pyproject.toml's dependencies (only what changed moves); `make lock
# UPGRADE=1` moves every dependency to its newest allowed version. Commit uv.lock with the change.
lock: venv
	.venv/bin/uv lock $(if $(UPGRADE),--upgrade,)

# The documentation site (docs/, mkdocs.yml; the reference pages are generated from the code as it builds):
# `make docs` builds it strictly into site/, `make docs-serve` serves it with live reload on 127.0.0.1:8001.
docs: venv
	NO_MKDOCS_2_WARNING=1 .venv/bin/python -m mkdocs build --strict --site-dir site

docs-serve: venv
	NO_MKDOCS_2_WARNING=1 .venv/bin/python -m mkdocs serve --dev-addr 127.0.0.1:8001
