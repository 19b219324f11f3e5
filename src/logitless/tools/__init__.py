"""The command-line tools: ``logitless check``, ``demo`` and ``bench``."""
