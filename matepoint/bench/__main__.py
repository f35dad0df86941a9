from matepoint.bench.cli import main

main()
