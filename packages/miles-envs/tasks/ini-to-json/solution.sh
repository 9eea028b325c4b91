#!/bin/sh
set -e
python3 -c "import configparser, json; c = configparser.ConfigParser(); c.read('settings.ini'); json.dump({s: dict(c[s]) for s in c.sections()}, open('settings.json', 'w'))"
