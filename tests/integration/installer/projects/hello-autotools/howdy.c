#include "config.h"
#ifdef SHOUT
int howdy(void) { return 2; }
#else
int howdy(void) { return 1; }
#endif
