"""The balancing state in a framework's checkpoint (BalancedTrainer's hetcomm_state.json,
BalancedStrategy's checkpoint["hetcomm"]), sealed with the digest of all it holds: the
data position, the splits to come, the rebalancer's estimates, and the run settings that
decide which samples each step draws (BalancedBatches.settings). On resume it is given
back only whole, of the checkpoint's own step and of this run's settings; anything else
is refused in one line naming the file and what to do, before any training step."""

from hetcomm.files.verified import CheckpointError
from hetcomm.files.verified_json import sealed, unsealed

# 1: BalancedBatches.state_dict() as it was, with no digest and without the dataset's
#    size, the seed or the balancing settings; refused (see restored). 2: sealed.
FORMAT = 2
ADVICE = "resume from another checkpoint, or start fresh"


def saved(batches) -> dict:
    """The document a checkpoint holds for `batches` (plain JSON values)."""
    return sealed({"batches": batches.state_dict()}, FORMAT)


def restored(document, where: str, who: str, steps: int | None = None) -> dict:
    """The balancing state in a document that `saved` made; CheckpointError (a
    ValueError) naming `where` when it is of format 1, damaged or edited, or after
    another step than the framework's own state in the checkpoint (`steps`)."""
    if isinstance(document, dict) and "format" not in document and "sampler" in document:
        raise CheckpointError(f"{who}: {where}: balancing state of format 1, written before hetcomm sealed it with "
                              f"a digest and the run's settings: nothing shows it is whole or of this run; {ADVICE}")
    try:
        state = unsealed(where, document, FORMAT).get("batches")
    except CheckpointError as error:
        raise CheckpointError(f"{who}: {error}; {ADVICE}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{who}: {where}: holds no balancing state; {ADVICE}")
    if steps is not None and state.get("steps") != steps:
        raise CheckpointError(f"{who}: {where}: balancing state after step {state.get('steps')!r}, the checkpoint's "
                              f"training state after step {steps}: they come from different checkpoints; {ADVICE}")
    return state


def load_into(batches, state: dict, where: str, who: str, **options) -> None:
    """batches.load_state_dict(state, **options), its refusal (a run of other settings)
    one CheckpointError naming `where`."""
    try:
        batches.load_state_dict(state, **options)
    except ValueError as error:
        raise CheckpointError(f"{who}: {where}: {str(error).removeprefix(who + ': ')}; {ADVICE}") from None
