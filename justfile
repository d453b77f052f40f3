# Daily commands. `just setup` once, then the others.
venv := ".venv"
py := venv / "bin/python"

# create the virtual environment and install LiveR with its development tools
setup:
    python3.11 -m venv {{venv}}
    {{venv}}/bin/pip install -e '.[dev]'

# run the whole test suite on every core (what CI runs)
test *args:
    {{venv}}/bin/pytest -q -n auto {{args}}

# the fast tier: every test that starts no process (no nats-server, no workers, no CLI subprocess);
# one worker more than cores (some tests wait on sockets), tests dealt one by one
test-fast *args:
    {{venv}}/bin/pytest -q -n `echo $(( $(nproc) + 1 ))` --dist load -m "not slow" {{args}}

# lint and check formatting
lint:
    {{venv}}/bin/ruff check .
    {{venv}}/bin/ruff format --check .

# format the code
fmt:
    {{venv}}/bin/ruff check --fix .
    {{venv}}/bin/ruff format .

# the main job: live scale-in and scale-out of a tiny GPT on CPU workers
demo:
    {{venv}}/bin/liver demo

# benchmarks: just bench plan [--json]
bench name *args:
    {{venv}}/bin/liver bench {{name}} {{args}}

# plan one resize, e.g. just plan --model gpt3-175b --from 8,16,8 --to 8,12,10
plan *args:
    {{venv}}/bin/liver plan {{args}}
