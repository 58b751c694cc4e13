import sys

from stabledrl.cli import main

sys.exit(main())
