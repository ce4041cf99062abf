import sys

from teacher_server.cli import main

sys.exit(main())
