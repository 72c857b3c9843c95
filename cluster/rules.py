"""Config checks of the cluster layer: user input fails with a ValueError naming the field, never an assert
(asserts vanish under `python -O`)."""


def check_rules(rules: dict[str, tuple[bool, str]]) -> None:
    """`rules` maps a field to (holds, what it must be); the first that fails raises."""
    for name, (holds, rule) in rules.items():
        if not holds:
            raise ValueError(f"{name}: {rule}")
