from vfab.cli.main import main

main()
