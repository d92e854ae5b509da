import sys

from peer.cli.swarm_peer import main

sys.exit(main())
