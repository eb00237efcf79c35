"""Command-line values with one number per rank ("1,1,0.5,0.25"), parsed with messages
that name the option."""


def parse_per_rank(option: str, text: str, world_size: int, convert, example: str) -> list:
    """Splits `text` at commas, converts each part, and insists on one value per rank."""
    kind = "whole numbers" if convert is int else "numbers" if convert is float else "values"
    try:
        values = [convert(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{option} {text!r}: expected comma-separated {kind} such as {example}") from None
    if len(values) != world_size:
        raise ValueError(f"{option} {text!r}: {len(values)} values for {world_size} ranks; give one per rank")
    return values
