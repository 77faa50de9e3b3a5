from qkiln.cli import main

main()
