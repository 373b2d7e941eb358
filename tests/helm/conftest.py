from __future__ import annotations

import sys
from pathlib import Path

# The test modules import `chart_helpers` from this folder (tests/helm is no
# package, like the other test folders).
sys.path.insert(0, str(Path(__file__).parent))
