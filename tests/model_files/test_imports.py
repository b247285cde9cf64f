"""splitbus.model_files runs in the API process, which has no paddle."""

from __future__ import annotations

import subprocess
import sys


def test_models_import_no_paddle() -> None:
    code = "import sys, splitbus.model_files.gguf; assert 'paddle' not in sys.modules, 'paddle was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
