"""``python -m zb_pipeline.schedule``: the ``zb-schedule`` command line."""

import sys

from zb_pipeline.schedule.cli import main

if __name__ == "__main__":
    sys.exit(main())
