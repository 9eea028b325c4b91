#!/bin/sh
set -e
python3 -c "import csv; print('%.2f' % sum(float(r['amount']) for r in csv.DictReader(open('sales.csv'))))" > total.txt
