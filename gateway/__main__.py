from gateway.cli import main

main()
