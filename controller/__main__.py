from vfab.controller.main import main

main()
