// A folder with no rule and not on the map.
#pragma once
