#!/bin/sh
# Exit status 0 = the task is solved. Runs from the sandbox root.
exec python3 - <<'CHECK'
rows = [l.strip() for l in open('sorted.csv') if l.strip()]
assert rows[0] == 'name,age', rows
ages = [int(r.split(',')[1]) for r in rows[1:]]
assert ages == sorted(ages) and len(ages) == 6, ages
assert sorted(rows[1:]) == sorted(l.strip() for l in open('people.csv').readlines()[1:] if l.strip())
print('ok')
CHECK
