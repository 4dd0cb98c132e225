import sys

from kvcompassd.cli import main

sys.exit(main())
