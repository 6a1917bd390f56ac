import sys

from fastpipe.cli import main

sys.exit(main())
