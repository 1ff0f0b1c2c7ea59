"""bench.modes's memory figures: the whole process tree of a job, as a job's Ray workers hang
below its driver (the bench itself runs for an hour; docs/modes.md has its figures)."""

import subprocess
import sys
import time

from bench.modes import _descendants, _tree_pss, _tree_rss


def test_a_jobs_memory_counts_every_process_below_it_once_per_process():
    # a driver whose child holds 64 MiB of its own, and a grandchild sharing nothing
    code = ("import subprocess, sys, time; b = bytes(range(256)) * (1 << 18); "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(p.pid, flush=True); time.sleep(60)")
    driver = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               f"c = subprocess.Popen([sys.executable, '-c', {code!r}], stdout=sys.stdout); "
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(driver.stdout.readline())
        tree = _descendants(driver.pid)
        assert len(tree) == 3 and tree[0] == driver.pid and grandchild in tree
        time.sleep(0.2)
        rss, pss = _tree_rss(tree), _tree_pss(tree)
        alone = _tree_rss([driver.pid])
        assert rss > alone + (64 << 20)  # the child's buffer is in the tree's memory
        assert 64 << 20 < pss <= rss  # shared pages (the interpreter's) count once in PSS
        assert _tree_rss([2**22 + 12345]) == 0  # a process gone meanwhile counts nothing
    finally:
        for pid in reversed(_descendants(driver.pid)):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        driver.wait()
