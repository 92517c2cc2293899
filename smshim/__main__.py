from smshim.launcher.cli import main

main()
