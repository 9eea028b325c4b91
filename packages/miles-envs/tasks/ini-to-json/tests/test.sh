#!/bin/sh
# Exit status 0 = the task is solved. Runs from the sandbox root.
exec python3 - <<'CHECK'
import json
got = json.load(open('settings.json'))
assert got == {'server': {'host': 'example.org', 'port': '8080'}, 'log': {'level': 'debug'}}, got
print('ok')
CHECK
