"""A run's settings: the one `Config` (config.py) and every check of it (checks.py), `--key=value`
parsing and --help (cli.py), what each field's annotation allows, for both (fieldtypes.py), TRL's settings
this trainer lacks (trl_names.py), the choices a setting may name (choices.py), recipe files (recipe.py),
the batch schedule resolved from a Config (schedule.py) and the run plan around it (plan.py).
Read by every other package; reads none of the runtime (only grpo/algo's choice lists)."""
from .config import Config

__all__ = ["Config"]
