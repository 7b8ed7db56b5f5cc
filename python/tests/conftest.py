import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# The tests' own models, and the example training scripts they run.
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
