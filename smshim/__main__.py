from smshim.cli import main

main()
