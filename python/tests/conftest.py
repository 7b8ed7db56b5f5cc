import atexit
import getpass
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
# The tests' own models, and the example training scripts they run.
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))

# `oomkit run` remembers the plan that finished per command in the user's cache
# and starts the same command from it next time. Tests that run one command
# twice across sessions (the same tmp path under a fresh /tmp) would then see
# the remembered plan instead of the retries they test, and they would leave
# entries in the user's own cache. Each test process keeps its own.
_CACHE = tempfile.mkdtemp(prefix="oomkit-test-cache-")
os.environ["OOMKIT_CACHE_DIR"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, True)

# What the tests' children leave in the temporary folder (torchrun's torchelastic_* logs,
# tokenizer and streaming caches, a killed run's scratch files) goes into one folder per
# test process, removed at its end: a run of the suite leaves nothing in /tmp. This process
# keeps the folder it already resolved (``mkdtemp`` above), so pytest's tmp_path stays there.
# Inductor's cache of compiled kernels stays where it was (it is meant to outlive a run, and
# the workers share what each compiled).
_CHILDREN_TMP = tempfile.mkdtemp(prefix="oomkit-test-tmp-")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))
os.environ["TMPDIR"] = _CHILDREN_TMP
atexit.register(shutil.rmtree, _CHILDREN_TMP, True)
