"""``python -m ringplug.forensics FILE...``: where the ranks' collectives parted."""

import sys

from ringplug.forensics.flight import main

sys.exit(main())
