import sys

from slcompile.cli import main

sys.exit(main())
