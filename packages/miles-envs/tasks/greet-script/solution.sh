#!/bin/sh
set -e
printf '#!/bin/sh\necho "hi $1"\n' > greet.sh && chmod +x greet.sh
