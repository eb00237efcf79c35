import sys

from hetcomm.cli import main

sys.exit(main())
