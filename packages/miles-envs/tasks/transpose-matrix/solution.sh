#!/bin/sh
set -e
python3 -c "rows = [l.split() for l in open('matrix.txt') if l.strip()]; open('transposed.txt', 'w').write(''.join(' '.join(c) + chr(10) for c in zip(*rows)))"
