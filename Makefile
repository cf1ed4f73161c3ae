# The two commands a newcomer needs: `make up` runs Fleet, `make test` runs the whole test suite.
# Both create .venv on first use (with uv, cached between runs).
.PHONY: up test venv lint bench lock

up:
	bash scripts/up.sh

test:
	bash scripts/test.sh

venv:
	bash scripts/venv.sh

lint: venv
	.venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/mypy

bench:
	bash scripts/bench.sh

# Re-resolve uv.lock after a change to pyproject.toml's dependencies (only what changed moves); `make lock
# UPGRADE=1` moves every dependency to its newest allowed version. Commit uv.lock with the change.
lock: venv
	.venv/bin/uv lock $(if $(UPGRADE),--upgrade,)
