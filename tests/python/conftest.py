import os
import sys

# The tests import the model in reference.py as a plain module. Only this folder
# goes on the path (never ../../python), so `import radixkv` still finds the
# installed package.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
