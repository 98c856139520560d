from qrag.cli.commands import main

raise SystemExit(main())
