import atexit
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
