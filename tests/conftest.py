"""Under pytest-xdist (`pytest -n auto`, the README's test command) every worker is a process with torch's own
thread pool: left alone, each would use every core and the workers would slow each other several-fold."""
import os

import pytest
import torch

_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))

# The suite's exact comparisons are float32's: every test plans as on a CPU without native bf16 (the precision
# plan's seam, policy/precision.ENV), whatever this machine's CPU does; the tests of the bf16 plan set it to 1.
os.environ.setdefault("GRPO_CPU_BF16", "0")


# The modules whose tests take minutes of CPU time (measured: test_learning 2.2, test_distributed 1.7), longest first
LONGEST = ["test_learning.py", "test_distributed.py"]


def pytest_collection_modifyitems(items):
    """The longest modules first, then the others with slow tests, then the rest, each module's tests kept together
    (its module-scoped fixtures set up once): a worker of pytest-xdist runs its share of tests in this order, so
    that a long test started last does not leave the other worker idle until it ends."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (LONGEST.index(item.path.name) if item.path.name in LONGEST else len(LONGEST),
                                 item.path not in slow))


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """`pytest -n N` hands tests out by work stealing: its default ("load") sends each worker batches of tests
    ahead, and a worker that is still busy with a long test keeps the short ones queued behind it while the other
    idles (measured: the slow modules, first in the order above, all went to one worker). With work stealing an
    idle worker takes half of what is queued on the other."""
    if config.getvalue("dist") == "load":
        from xdist.scheduler import WorkStealingScheduling

        return WorkStealingScheduling(config, log)
    return None
