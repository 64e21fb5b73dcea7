"""A run's settings: the one `Config` (config.py); TRL's settings as this trainer takes them: refused, accepted
with a warning, or spelled as ours (trl_names.py); grpo's checks of the values (checks.py), with what each field's
annotation allows (fieldtypes.py) and the choices a setting may name (choices.py); the run plan (plan.py), its batch
schedule (schedule.py) and each component's settings (components.py); `--key=value` parsing and --help (cli.py);
recipe files (recipe.py). Read by every other package; reads none of the runtime (only grpo/algo's choice lists)."""
from .config import Config

__all__ = ["Config"]
