import sys

from stagetrace.exporter.process import main

sys.exit(main())
