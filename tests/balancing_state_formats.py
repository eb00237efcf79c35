"""The integrations' balancing state as earlier releases wrote it, for the tests that
check a resume refuses it."""


def as_format_1(state: dict) -> dict:
    """A balancing state as hetcomm wrote it before format 2: no digest, no run settings
    but these three."""
    run = state["run"]
    return {**{k: v for k, v in state.items() if k != "run"},
            **{k: run[k] for k in ("global_batch", "accumulation", "world")}}
