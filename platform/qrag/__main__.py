from .cli.commands import main

raise SystemExit(main())
