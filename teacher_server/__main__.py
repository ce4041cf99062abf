import sys

from teacher_server.entry import main

sys.exit(main())
