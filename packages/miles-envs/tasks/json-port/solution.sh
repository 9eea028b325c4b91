#!/bin/sh
set -e
python3 -c "import json; print(json.load(open('config.json'))['database']['port'])" > port.txt
