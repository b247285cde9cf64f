import sys

from splitbus.cli.main import main

sys.exit(main())
