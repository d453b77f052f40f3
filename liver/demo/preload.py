"""Imported first by the workers' fork server: keeps third-party import chatter out of the demo's output.

Megatron-core warns at import time that Transformer Engine and Apex are missing (on a CPU laptop they
always are). The fork server shares the demo's terminal, so without this the progress display would
start with a screenful of warnings that say nothing about the run.
"""

from __future__ import annotations

import warnings

warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
