from distml.cli.main import main

main()
