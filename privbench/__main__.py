from privbench.cli import main

main()
