"""How the tests' spawned learner ranks end: as Ray ends a learner rank, without the interpreter's
exit.

A rank is a Ray actor in a run (launch/supervise.py), and Ray ends it by killing its process, so a
rank never runs Python's finalization. A test's plain `multiprocessing` rank does, and there gloo's
worker threads can still be letting go of a finished collective's tensors: freeing a tensor that
has a Python object takes the GIL, which a thread cannot take while the interpreter is torn down,
and the process aborts ("terminate called without an active exception", exit -6 or -11) after the
rank did all its work (pytorch/pytorch PR 179291). So the tests' ranks end as the runs' do: the
rank's results are flushed to the parent, then the process exits at once, 0 if the rank returned and
1, with its traceback on stderr, if it raised.

Usage::

    ctx.Process(target=as_rank, args=(_rank, rank, model, url, out))  # `out`, a Queue, last
"""

import os
import sys
import traceback


def as_rank(target, *args) -> None:
    """Run `target(*args)` in this process, then end it (see above); `args[-1]` is the queue the
    rank puts its results in."""
    out, code = args[-1], 1
    try:
        target(*args)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        out.close()
        out.join_thread()  # every result the rank put is in the pipe to the parent
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
