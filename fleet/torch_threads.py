"""Torch's intra-op thread count for one thread, leaving every other thread's as it was.

``torch.set_num_threads`` sets the calling thread's count (its OpenMP team, its MKL threads) and also the count
every thread takes when it first runs torch. A replica thread of one worker (``fleet.consumers.replicas``) or the
gateway's L3 embedder thread that set its own count would otherwise hand it to every model thread started after it
in the process: under ``fleet up``, a second model's worker would run on the first one's replica share.
``set_for_this_thread`` sets the count, then sets the process's back from a short-lived thread of its own.
torch is imported only when called, and a process without it is left alone.
"""

from __future__ import annotations

import threading


def set_for_this_thread(threads: int) -> None:
    """Run torch in the calling thread with ``threads`` intra-op threads; threads started later keep the process's."""
    try:
        import torch
    except ImportError:  # a handler or test embedder that does not use torch
        return
    before = torch.get_num_threads()  # this thread's count until now: the process's, for a new thread
    if before == threads:
        return
    torch.set_num_threads(threads)
    restore = threading.Thread(target=torch.set_num_threads, args=(before,), name="torch-threads-restore")
    restore.start()
    restore.join()
