"""SIGTERM's handler never waits for the exit work running in the SIGTERM thread (real processes).

The flake this pins: a rank of ``examples/bugs/dtype_mismatch.py`` raised, and while its main thread
imported a module (for a log line of its exit dump), the launcher's SIGTERM came. The SIGTERM thread
ran the exit verdict, which imported that module too and waited for the main thread's import; the
main thread's handler, inside that import, waited for the SIGTERM thread's actions. Both waited
until the launcher's SIGKILL 30 s later, and the job got no verdict (1 run in 3 under load).

Here the order is forced: the main thread blocks SIGTERM while it imports ``slowmod`` (so the
signal goes to the SIGTERM thread, whose action then waits for that import), and unblocks it inside
the import, where its handler runs.
"""

import os
import signal
import subprocess
import sys
import textwrap

from tests.procs import ROOT, env_for

SLOWMOD = textwrap.dedent("""
    import ctypes, os, signal, time
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    os.kill(os.getpid(), signal.SIGTERM)     # delivered to the SIGTERM thread: its action starts
    ctypes.CDLL(None).usleep(500000)          # (no signal check, GIL released) it waits for this import
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    for _ in range(10):                       # the main thread's handler runs here, inside the import
        time.sleep(0.05)
    VALUE = 42
""")

MAIN = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    sys.path.insert(0, {here!r})
    from hangdoc.runtime import on_term

    def action():
        import slowmod   # the module the main thread is importing when SIGTERM comes
        os.write(1, b"ACTION-DONE %d\\n" % slowmod.VALUE)

    on_term.install(action)
    import slowmod
    os.write(1, b"IMPORTED\\n")
    time.sleep(30)
    os.write(1, b"NOT-ENDED\\n")
""")


def test_a_sigterm_during_an_import_the_exit_action_needs_ends_the_process_after_the_action(tmp_path):
    (tmp_path / "slowmod.py").write_text(SLOWMOD)
    script = tmp_path / "main.py"
    script.write_text(MAIN.format(root=ROOT, here=str(tmp_path)))
    proc = subprocess.Popen([sys.executable, str(script)], env=env_for(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=25)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError("deadlocked: the handler waited for the action, the action for the import\n" + out)
    assert "ACTION-DONE 42" in out, out
    assert "NOT-ENDED" not in out, out
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, out)
