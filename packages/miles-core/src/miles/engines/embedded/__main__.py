from miles.engines.embedded.server import main

main()
